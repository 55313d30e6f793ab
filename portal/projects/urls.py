from django.urls import path

from portal.projects import views

urlpatterns = [
    path("projects/", views.project_list, name="project-list"),
    path("projects/<slug:slug>/", views.project_detail, name="project-detail"),
    path("projects/<slug:slug>/members/", views.project_members, name="project-members"),
]
